/*
 * A stand-in libnvidia-ml.so.1 for dlmon's tests: the real nvidia-ml-py bindings load it
 * through LD_LIBRARY_PATH and call it with their own ctypes structs, so a wrong struct
 * layout, a wrong return code or a broken two-call process list shows up as it would on a
 * driver.
 *
 * Behaviour follows NVML's documentation (nvml.h of the R5xx drivers):
 *   - every call before nvmlInit* (or after the last nvmlShutdown) is NVML_ERROR_UNINITIALIZED;
 *     init is reference counted;
 *   - nvmlDeviceGetHandleByIndex_v2 with index >= count is NVML_ERROR_INVALID_ARGUMENT;
 *   - string getters with a too small buffer are NVML_ERROR_INSUFFICIENT_SIZE;
 *   - nvmlDeviceGetMemoryInfo_v2 checks the struct's version (nvmlMemory_v2 = 0x02000028),
 *     else NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
 *   - the process lists: *infoCount in/out; with no process, NVML_SUCCESS and 0; when
 *     *infoCount is smaller than the number of processes (the first call passes 0 and NULL),
 *     *infoCount is set to it and NVML_ERROR_INSUFFICIENT_SIZE returned; the _v2/_v3 calls
 *     fill nvmlProcessInfo_t {uint pid; ull usedGpuMemory; uint gpuInstanceId;
 *     uint computeInstanceId} (24 bytes), the unversioned call nvmlProcessInfo_v1_t
 *     {uint pid; ull usedGpuMemory} (16 bytes).
 *
 * Configuration: the file named by $DLMON_FAKE_NVML, read at the first nvmlInit*, one
 * directive a line ("#" starts a comment); when it is set but cannot be opened, nvmlInit*
 * fails (NVML_ERROR_UNKNOWN); unset, one default device:
 *   driver 550.54.15          driver version string
 *   init_error 9              nvmlInit* fails with this code
 *   device                    starts a device; the lines below describe it
 *   name NVIDIA H200          (rest of the line)
 *   uuid GPU-...
 *   total 150754820096        bytes; also: used, reserved (v2 struct's), util (percent)
 *   compute 1234 1073741824   a compute process and its VRAM ("na": NVML_VALUE_NOT_AVAILABLE)
 *   graphics 1234 na          a graphics process
 *   delay_ms 8000             each device call on this device sleeps this long first ...
 *   delay_fn nvmlDeviceGetMemoryInfo_v2   ... or only this one
 *   hang_after_ms 1500        ... and only from this long after the first nvmlInit on
 *                             (a GPU that falls off the bus mid-run)
 *   fail nvmlDeviceGetUtilizationRates 3  this call on this device returns this code
 *   minor 3                   its /dev/nvidiaN number (nvmlDeviceGetMinorNumber; default: index)
 *   mig 1                     the device is MIG capable, MIG mode on (0: capable, mode off).
 *                             In MIG mode, as NVML documents and as in a pod without admin
 *                             rights: the parent handle's memory and process lists answer
 *                             NVML_ERROR_NO_PERMISSION (aggregate figures need privileges),
 *                             its utilisation NVML_ERROR_NOT_SUPPORTED; MIG handles answer
 *                             memory and processes, and utilisation NOT_SUPPORTED too
 *   mig_privileged            ... unless this: the parent answers the aggregate figures (root)
 *   mig_device 2              a MIG device in slot 2 (of nvmlDeviceGetMaxMigDeviceCount's 7) of
 *                             the device above; name, uuid, total, used, compute, fail lines
 *                             below describe it, up to the next device or mig_device
 *   sm 1234 45                process 1234's SM utilisation samples say 45% (a new sample each
 *                             nvmlDeviceGetProcessUtilization call, timestamped now; only those
 *                             newer than lastSeenTimeStamp are returned, else NOT_FOUND)
 *   power_mw 300000           the energy counter grows at this rate (mJ/s) from the first init
 *   clock_events 0x40         nvmlDeviceGetCurrentClocksEventReasons' bitmask
 *   gpm_sm 12.5               GPM is supported (Hopper): nvmlGpmMetricsGet's SM utilisation ...
 *   gpm_occupancy 4           ... and SM occupancy between two samples (percent)
 *   pcie_rx_bps 4000000000    the PCIe byte counters (field values 198 rx, 197 tx) grow at these
 *   pcie_tx_bps 1000000       rates from the first init; unset: NOT_SUPPORTED in the field's nvmlReturn
 *   pcie_value_type 1         the counters' nvmlValueType_t (default 3, unsigned long long; 1:
 *                             unsigned int, the counter wrapping at 2^32)
 *   reload_after_ms 1500      (global) the driver is reloaded this long after the first init:
 *                             every call answers NVML_ERROR_UNINITIALIZED until nvmlInit* is
 *                             called again
 * Without $DLMON_FAKE_NVML: one device, no processes.
 *
 * Build: gcc -shared -fPIC -O1 -o libnvidia-ml.so.1 fake_nvml.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_VALUE_NOT_AVAILABLE_ULL (~0ULL)
#define NVML_MEMORY_V2 0x02000028u
#define MAX_DEVICES 16
#define MAX_PROCS 64
#define MAX_FAILS 8
#define MAX_MIGS 32
#define MAX_MIG_SLOTS 7 /* H100/H200: seven 1g slices */
#define NVML_DEVICE_MIG_ENABLE 1

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long used;
} proc_t;

typedef struct {
    char fn[96];
    int code;
} fail_t;

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned int pid, sm;
} sm_t;

typedef struct fake_device {
    unsigned int index;
    char name[96];
    char uuid[96];
    unsigned long long total, used, reserved;
    unsigned int util;
    proc_t compute[MAX_PROCS], graphics[MAX_PROCS];
    unsigned int n_compute, n_graphics;
    long delay_ms;
    long hang_after_ms;
    char delay_fn[96];
    fail_t fails[MAX_FAILS];
    unsigned int n_fails;
    int mig_capable, mig_mode, mig_privileged;
    unsigned int minor;
    struct fake_device *parent; /* set on a MIG device */
    unsigned int mig_slot;
    sm_t sm[MAX_PROCS];
    unsigned int n_sm;
    unsigned long long power_mw, clock_events;
    unsigned long long pcie_rx_bps, pcie_tx_bps;
    unsigned int pcie_value_type;
    int gpm;
    double gpm_sm, gpm_occupancy;
} fake_device;

typedef fake_device *nvmlDevice_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int refcount;
static int configured;
static int init_error;
static char driver[80] = "550.54.15";
static fake_device devices[MAX_DEVICES];
static unsigned int n_devices;
static fake_device migs[MAX_MIGS];
static unsigned int n_migs;
static long reload_after_ms;
static int reloaded;
static struct timespec init_time;

static long ms_since_init(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - init_time.tv_sec) * 1000L + (now.tv_nsec - init_time.tv_nsec) / 1000000L;
}

static void chomp(char *s) {
    size_t n = strlen(s);
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ')) s[--n] = 0;
}

static void add_proc(proc_t *list, unsigned int *n, const char *rest) {
    unsigned int pid;
    char used[64];
    if (*n >= MAX_PROCS || sscanf(rest, "%u %63s", &pid, used) != 2) return;
    list[*n].pid = pid;
    list[*n].used = strcmp(used, "na") == 0 ? NVML_VALUE_NOT_AVAILABLE_ULL : strtoull(used, NULL, 10);
    (*n)++;
}

static fake_device *new_device(void) {
    fake_device *d = &devices[n_devices];
    memset(d, 0, sizeof *d);
    d->index = n_devices;
    d->minor = n_devices;
    snprintf(d->name, sizeof d->name, "NVIDIA H200");
    snprintf(d->uuid, sizeof d->uuid, "GPU-fake-%u", n_devices);
    d->total = 150754820096ULL;
    d->used = 10ULL << 30;
    d->reserved = 512ULL << 20;
    d->util = 37;
    n_devices++;
    return d;
}

static fake_device *new_mig(fake_device *parent, const char *rest) {
    if (parent == NULL || n_migs >= MAX_MIGS) return NULL;
    fake_device *m = &migs[n_migs];
    memset(m, 0, sizeof *m);
    m->parent = parent;
    m->mig_slot = (unsigned int)atoi(rest);
    m->index = parent->index;
    snprintf(m->name, sizeof m->name, "%.80s MIG 1g.18gb", parent->name);
    snprintf(m->uuid, sizeof m->uuid, "MIG-fake-%u-%u", parent->index, m->mig_slot);
    m->total = 16ULL << 30;
    m->used = 0;
    n_migs++;
    return m;
}

static void configure(void) {
    const char *path = getenv("DLMON_FAKE_NVML");
    FILE *fh = path ? fopen(path, "r") : NULL;
    char line[512];
    fake_device *d = NULL, *physical = NULL;
    configured = 1;
    if (fh == NULL && path != NULL) {
        /* A mistyped config path must not pass for the one-device default. */
        fprintf(stderr, "fake_nvml: cannot open DLMON_FAKE_NVML=%s\n", path);
        init_error = NVML_ERROR_UNKNOWN;
        return;
    }
    if (fh == NULL) {
        new_device();
        return;
    }
    while (fgets(line, sizeof line, fh)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        chomp(line);
        char *rest = strchr(line, ' ');
        if (rest) *rest++ = 0; else rest = line + strlen(line);
        if (strcmp(line, "device") == 0) {
            d = physical = n_devices < MAX_DEVICES ? new_device() : NULL;
        } else if (strcmp(line, "mig_device") == 0) {
            d = new_mig(physical, rest);
        } else if (strcmp(line, "reload_after_ms") == 0) {
            reload_after_ms = atol(rest);
        } else if (strcmp(line, "driver") == 0) {
            snprintf(driver, sizeof driver, "%s", rest);
        } else if (strcmp(line, "init_error") == 0) {
            init_error = atoi(rest);
        } else if (d == NULL) {
            continue;
        } else if (strcmp(line, "name") == 0) {
            snprintf(d->name, sizeof d->name, "%s", rest);
        } else if (strcmp(line, "uuid") == 0) {
            snprintf(d->uuid, sizeof d->uuid, "%s", rest);
        } else if (strcmp(line, "total") == 0) {
            d->total = strtoull(rest, NULL, 10);
        } else if (strcmp(line, "used") == 0) {
            d->used = strtoull(rest, NULL, 10);
        } else if (strcmp(line, "reserved") == 0) {
            d->reserved = strtoull(rest, NULL, 10);
        } else if (strcmp(line, "util") == 0) {
            d->util = (unsigned int)atoi(rest);
        } else if (strcmp(line, "compute") == 0) {
            add_proc(d->compute, &d->n_compute, rest);
        } else if (strcmp(line, "graphics") == 0) {
            add_proc(d->graphics, &d->n_graphics, rest);
        } else if (strcmp(line, "delay_ms") == 0) {
            d->delay_ms = atol(rest);
        } else if (strcmp(line, "hang_after_ms") == 0) {
            d->hang_after_ms = atol(rest);
        } else if (strcmp(line, "delay_fn") == 0) {
            snprintf(d->delay_fn, sizeof d->delay_fn, "%s", rest);
        } else if (strcmp(line, "sm") == 0 && d->n_sm < MAX_PROCS) {
            if (sscanf(rest, "%u %u", &d->sm[d->n_sm].pid, &d->sm[d->n_sm].sm) == 2) d->n_sm++;
        } else if (strcmp(line, "power_mw") == 0) {
            d->power_mw = strtoull(rest, NULL, 10);
        } else if (strcmp(line, "gpm_sm") == 0) {
            d->gpm = 1;
            d->gpm_sm = atof(rest);
        } else if (strcmp(line, "gpm_occupancy") == 0) {
            d->gpm = 1;
            d->gpm_occupancy = atof(rest);
        } else if (strcmp(line, "pcie_rx_bps") == 0) {
            d->pcie_rx_bps = strtoull(rest, NULL, 10);
        } else if (strcmp(line, "pcie_tx_bps") == 0) {
            d->pcie_tx_bps = strtoull(rest, NULL, 10);
        } else if (strcmp(line, "pcie_value_type") == 0) {
            d->pcie_value_type = (unsigned int)strtoul(rest, NULL, 10);
        } else if (strcmp(line, "clock_events") == 0) {
            d->clock_events = strtoull(rest, NULL, 0);
        } else if (strcmp(line, "minor") == 0) {
            d->minor = (unsigned int)atoi(rest);
        } else if (strcmp(line, "mig") == 0) {
            d->mig_capable = 1;
            d->mig_mode = atoi(rest) == 1;
        } else if (strcmp(line, "mig_privileged") == 0) {
            d->mig_privileged = 1;
        } else if (strcmp(line, "fail") == 0 && d->n_fails < MAX_FAILS) {
            fail_t *f = &d->fails[d->n_fails];
            if (sscanf(rest, "%95s %d", f->fn, &f->code) == 2) d->n_fails++;
        }
    }
    fclose(fh);
}

static int initialized(void) {
    pthread_mutex_lock(&lock);
    if (reload_after_ms > 0 && !reloaded && refcount > 0 && ms_since_init() >= reload_after_ms) {
        reloaded = 1; /* the driver went away and came back: every client must init again */
        refcount = 0;
    }
    int up = refcount > 0;
    pthread_mutex_unlock(&lock);
    return up;
}

static int valid(nvmlDevice_t d) {
    return (d >= devices && d < devices + n_devices) || (d >= migs && d < migs + n_migs);
}

static int in_mig_mode(nvmlDevice_t d) {
    return d->parent == NULL && d->mig_mode;
}

/* The parent of a MIG-mode device answers aggregate memory and process figures only to the
   privileged (nvml.h: "In MIG mode, if device handle is provided, the API returns aggregate
   information, only if the caller has appropriate privileges"). */
static nvmlReturn_t aggregate(nvmlDevice_t d) {
    return in_mig_mode(d) && !d->mig_privileged ? NVML_ERROR_NO_PERMISSION : NVML_SUCCESS;
}

/* The common start of a device call: init, handle, the configured hang and failure. */
static nvmlReturn_t enter(nvmlDevice_t d, const char *fn) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->delay_ms > 0 && (d->delay_fn[0] == 0 || strcmp(d->delay_fn, fn) == 0) &&
        ms_since_init() >= d->hang_after_ms) {
        struct timespec ts = {d->delay_ms / 1000, (d->delay_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    for (unsigned int i = 0; i < d->n_fails; i++)
        if (strcmp(d->fails[i].fn, fn) == 0) return d->fails[i].code;
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(const char *value, char *out, unsigned int length) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    if (!configured) {
        configure();
        clock_gettime(CLOCK_MONOTONIC, &init_time);
    }
    nvmlReturn_t ret = init_error ? init_error : NVML_SUCCESS;
    if (ret == NVML_SUCCESS) refcount++;
    pthread_mutex_unlock(&lock);
    return ret;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (refcount > 0) refcount--;
    pthread_mutex_unlock(&lock);
    return ret;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    return copy_string(driver, version, length);
}

static unsigned long count_calls; /* one per sweep: how many sweeps a test's process made */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    __atomic_add_fetch(&count_calls, 1, __ATOMIC_SEQ_CST);
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = n_devices;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= n_devices) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = enter(&devices[index], "nvmlDeviceGetHandleByIndex_v2");
    if (ret != NVML_SUCCESS) return ret;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetName");
    return ret != NVML_SUCCESS ? ret : copy_string(d->name, name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetUUID");
    return ret != NVML_SUCCESS ? ret : copy_string(d->uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetMemoryInfo");
    if (ret == NVML_SUCCESS) ret = aggregate(d);
    if (ret != NVML_SUCCESS) return ret;
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = d->total;
    memory->used = d->used + d->reserved; /* v1's used counts the driver's reserve */
    memory->free = memory->used > d->total ? 0 : d->total - memory->used; /* unsigned: no wrap */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *memory) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetMemoryInfo_v2");
    if (ret == NVML_SUCCESS) ret = aggregate(d);
    if (ret != NVML_SUCCESS) return ret;
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = d->total;
    memory->reserved = d->reserved;
    memory->used = d->used;
    memory->free = d->reserved + d->used > d->total ? 0 : d->total - d->reserved - d->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *utilization) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetUtilizationRates");
    if (ret != NVML_SUCCESS) return ret;
    /* "On MIG-enabled GPUs, querying device utilization rates is not currently supported." */
    if (d->parent != NULL || in_mig_mode(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (utilization == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = d->util;
    utilization->memory = d->util / 2;
    return NVML_SUCCESS;
}

static const proc_t no_procs[1];

/* The two-call protocol of every process list. */
static nvmlReturn_t list(nvmlDevice_t d, const char *fn, const proc_t *procs, unsigned int n,
                         unsigned int *count, void *infos, int v1) {
    nvmlReturn_t ret = enter(d, fn);
    if (ret == NVML_SUCCESS) ret = aggregate(d);
    if (ret != NVML_SUCCESS) return ret;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < n || (infos == NULL && n > 0)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) {
        if (v1) {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + i;
            out->pid = procs[i].pid;
            out->usedGpuMemory = procs[i].used;
        } else {
            nvmlProcessInfo_t *out = (nvmlProcessInfo_t *)infos + i;
            out->pid = procs[i].pid;
            out->usedGpuMemory = procs[i].used;
            /* a MIG device's processes carry its instance ids; else "not in a MIG instance" */
            out->gpuInstanceId = d->parent != NULL ? d->mig_slot : 0xFFFFFFFFu;
            out->computeInstanceId = d->parent != NULL ? 0 : 0xFFFFFFFFu;
        }
    }
    *count = n;
    return NVML_SUCCESS;
}

#define LISTS(kind, field)                                                                       \
    nvmlReturn_t nvmlDeviceGet##kind##RunningProcesses_v3(nvmlDevice_t d, unsigned int *c,       \
                                                           nvmlProcessInfo_t *p) {               \
        return list(d, "nvmlDeviceGet" #kind "RunningProcesses_v3", valid(d) ? d->field : no_procs, valid(d) ? d->n_##field : 0, c, p, 0); \
    }                                                                                            \
    nvmlReturn_t nvmlDeviceGet##kind##RunningProcesses_v2(nvmlDevice_t d, unsigned int *c,       \
                                                           nvmlProcessInfo_t *p) {               \
        return list(d, "nvmlDeviceGet" #kind "RunningProcesses_v2", valid(d) ? d->field : no_procs, valid(d) ? d->n_##field : 0, c, p, 0); \
    }                                                                                            \
    nvmlReturn_t nvmlDeviceGet##kind##RunningProcesses(nvmlDevice_t d, unsigned int *c,          \
                                                        nvmlProcessInfo_v1_t *p) {               \
        return list(d, "nvmlDeviceGet" #kind "RunningProcesses", valid(d) ? d->field : no_procs, valid(d) ? d->n_##field : 0, c, p, 1); \
    }

LISTS(Compute, compute)
LISTS(Graphics, graphics)

/* MPS: no MPS server in these tests; the lists are empty. */
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p) {
    return list(d, "nvmlDeviceGetMPSComputeRunningProcesses_v3", no_procs, 0, c, p, 0);
}
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p) {
    return list(d, "nvmlDeviceGetMPSComputeRunningProcesses_v2", no_procs, 0, c, p, 0);
}
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v1_t *p) {
    return list(d, "nvmlDeviceGetMPSComputeRunningProcesses", no_procs, 0, c, p, 1);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetMinorNumber");
    if (ret != NVML_SUCCESS) return ret;
    if (minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->parent != NULL) return NVML_ERROR_NOT_SUPPORTED; /* a MIG device has no /dev/nvidiaN */
    *minor = d->minor;
    return NVML_SUCCESS;
}

/* MIG. A device without the mig directive is not MIG capable (NVML_ERROR_NOT_SUPPORTED). */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetMigMode");
    if (ret != NVML_SUCCESS) return ret;
    if (current == NULL || pending == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->parent != NULL || !d->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = d->mig_mode ? NVML_DEVICE_MIG_ENABLE : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetMaxMigDeviceCount");
    if (ret != NVML_SUCCESS) return ret;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->parent != NULL || !d->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    *count = MAX_MIG_SLOTS;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index, nvmlDevice_t *mig) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetMigDeviceHandleByIndex");
    if (ret != NVML_SUCCESS) return ret;
    if (mig == NULL || d->parent != NULL || !d->mig_capable || index >= MAX_MIG_SLOTS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->mig_mode) return NVML_ERROR_NOT_FOUND;
    for (unsigned int i = 0; i < n_migs; i++) {
        if (migs[i].parent == d && migs[i].mig_slot == index) {
            *mig = &migs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND; /* an empty slot */
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned int *is_mig) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d) || is_mig == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *is_mig = d->parent != NULL;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t d, nvmlDevice_t *parent) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d) || parent == NULL || d->parent == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *parent = d->parent;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t d, unsigned int *id) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetGpuInstanceId");
    if (ret != NVML_SUCCESS) return ret;
    if (id == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->parent == NULL) return NVML_ERROR_NOT_SUPPORTED;
    *id = d->mig_slot;
    return NVML_SUCCESS;
}

/* Not NVML: how many times nvmlDeviceGetCount was called (each dlmon sweep calls it once). */
unsigned long fakeNvmlCountCalls(void) { return __atomic_load_n(&count_calls, __ATOMIC_SEQ_CST); }

/* Not NVML: the driver's struct sizes, for the tests to hold the bindings' ctypes against. */
unsigned int fakeNvmlSizeofProcessInfo(void) { return (unsigned int)sizeof(nvmlProcessInfo_t); }
unsigned int fakeNvmlSizeofProcessInfoV1(void) { return (unsigned int)sizeof(nvmlProcessInfo_v1_t); }
unsigned int fakeNvmlSizeofMemoryV2(void) { return (unsigned int)sizeof(nvmlMemory_v2_t); }

/* Per-process utilisation (nvml.h): the first call with utilization NULL sizes the buffer
   (NVML_ERROR_INSUFFICIENT_SIZE and the count); samples are those newer than
   lastSeenTimeStamp; none: NVML_ERROR_NOT_FOUND. Not supported on MIG. */
static unsigned long long last_seen_asked;

unsigned long long fakeNvmlLastSeenTimestamp(void) { return last_seen_asked; }

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *count, unsigned long long lastSeenTimeStamp) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetProcessUtilization");
    if (ret != NVML_SUCCESS) return ret;
    if (d->parent != NULL || in_mig_mode(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    last_seen_asked = lastSeenTimeStamp;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    unsigned long long stamp = (unsigned long long)now.tv_sec * 1000000ULL + now.tv_nsec / 1000;
    unsigned int n = stamp > lastSeenTimeStamp ? d->n_sm : 0;
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (utilization == NULL || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) {
        utilization[i].pid = d->sm[i].pid;
        utilization[i].timeStamp = stamp;
        utilization[i].smUtil = d->sm[i].sm;
        utilization[i].memUtil = d->sm[i].sm / 2;
        utilization[i].encUtil = utilization[i].decUtil = 0;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *energy) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetTotalEnergyConsumption");
    if (ret != NVML_SUCCESS) return ret;
    if (d->power_mw == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (energy == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *energy = d->power_mw * (unsigned long long)ms_since_init() / 1000ULL;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *reasons) {
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetCurrentClocksEventReasons");
    if (ret != NVML_SUCCESS) return ret;
    if (reasons == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *reasons = d->clock_events;
    return NVML_SUCCESS;
}

/* nvmlFieldValue_t (nvml.h): each requested field answers in its own nvmlReturn; the call itself
   succeeds. Only the PCIe byte counters are modelled. */
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType; /* NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3 */
    nvmlReturn_t nvmlReturn;
    union {
        double dVal;
        unsigned int uiVal;
        unsigned long long ullVal;
    } value;
} nvmlFieldValue_t;

static unsigned long field_value_calls;

/* Not NVML: how many times nvmlDeviceGetFieldValues was called. */
unsigned long fakeNvmlFieldValueCalls(void) { return __atomic_load_n(&field_value_calls, __ATOMIC_SEQ_CST); }

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    __atomic_add_fetch(&field_value_calls, 1, __ATOMIC_SEQ_CST);
    nvmlReturn_t ret = enter(d, "nvmlDeviceGetFieldValues");
    if (ret != NVML_SUCCESS) return ret;
    if (values == NULL || count < 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    long long stamp = (long long)now.tv_sec * 1000000LL + now.tv_nsec / 1000;
    unsigned long long ms = (unsigned long long)ms_since_init();
    for (int i = 0; i < count; i++) {
        unsigned long long rate = values[i].fieldId == 198 ? d->pcie_rx_bps : values[i].fieldId == 197 ? d->pcie_tx_bps : 0;
        values[i].timestamp = stamp;
        values[i].latencyUsec = 0;
        if (rate == 0) {
            values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        values[i].nvmlReturn = NVML_SUCCESS;
        if (d->pcie_value_type == 1) {
            values[i].valueType = 1;
            values[i].value.uiVal = (unsigned int)(rate / 1000ULL * ms); /* wraps at 2^32 */
        } else {
            values[i].valueType = 3;
            values[i].value.ullVal = rate / 1000ULL * ms;
        }
    }
    return NVML_SUCCESS;
}

/* GPM (nvml.h, Hopper and later): samples allocated by the caller, taken on a device, and the
   metrics between two of the same device. */
typedef struct {
    unsigned int version, isSupportedDevice;
} nvmlGpmSupport_t;

typedef struct fake_gpm_sample {
    fake_device *device;
    long ms;
} *nvmlGpmSample_t;

typedef struct {
    char *shortName, *longName, *unit;
} gpm_metric_info_t;

typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    gpm_metric_info_t metricInfo;
} nvmlGpmMetric_t;

typedef struct {
    unsigned int version, numMetrics;
    nvmlGpmSample_t sample1, sample2;
    nvmlGpmMetric_t metrics[1]; /* numMetrics of them */
} nvmlGpmMetricsGet_t;

static long gpm_samples_live;

long fakeNvmlGpmSamplesLive(void) { return gpm_samples_live; }

static unsigned long gpm_support_calls;

/* Not NVML: how many times nvmlGpmQueryDeviceSupport was called. */
unsigned long fakeNvmlGpmSupportCalls(void) { return __atomic_load_n(&gpm_support_calls, __ATOMIC_SEQ_CST); }

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t d, nvmlGpmSupport_t *support) {
    __atomic_add_fetch(&gpm_support_calls, 1, __ATOMIC_SEQ_CST);
    nvmlReturn_t ret = enter(d, "nvmlGpmQueryDeviceSupport");
    if (ret != NVML_SUCCESS) return ret;
    if (support == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (support->version != 1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    support->isSupportedDevice = d->gpm && d->parent == NULL;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (sample == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *sample = calloc(1, sizeof **sample);
    if (*sample == NULL) return NVML_ERROR_UNKNOWN;
    gpm_samples_live++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample) {
    if (sample == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    free(sample);
    gpm_samples_live--;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t d, nvmlGpmSample_t sample) {
    nvmlReturn_t ret = enter(d, "nvmlGpmSampleGet");
    if (ret != NVML_SUCCESS) return ret;
    if (sample == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->gpm || d->parent != NULL) return NVML_ERROR_NOT_SUPPORTED;
    sample->device = d;
    sample->ms = ms_since_init();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (m == NULL || m->sample1 == NULL || m->sample2 == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != 1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    fake_device *d = m->sample1->device;
    if (d == NULL || d != m->sample2->device) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < m->numMetrics; i++) {
        nvmlGpmMetric_t *x = &m->metrics[i];
        x->metricInfo.shortName = x->metricInfo.longName = x->metricInfo.unit = NULL;
        if (x->metricId == 2) { /* NVML_GPM_METRIC_SM_UTIL */
            x->value = d->gpm_sm;
            x->nvmlReturn = NVML_SUCCESS;
        } else if (x->metricId == 3) { /* NVML_GPM_METRIC_SM_OCCUPANCY */
            x->value = d->gpm_occupancy;
            x->nvmlReturn = NVML_SUCCESS;
        } else {
            x->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}
