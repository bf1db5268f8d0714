"""``dlmon cluster``: many nodes' dlmon exporters read back into one view.

``exposition`` parses the text format, ``readings`` holds what one node answered, ``view`` turns
readings into frozen rows per node and rank with the cluster's straggler (pure, no I/O),
``scrape`` reads the nodes' exporters directly, ``promapi`` a Prometheus server's HTTP API (both
through ``bounded``: a whole answer within a deadline and a size),
``trend`` each node's recent batches/s and data wait in bounded slots (range queries, or the
direct form's own history), ``hosts`` the node lists (``--hosts-file``, ``SLURM_JOB_NODELIST``),
``command`` runs it.
"""
