"""``dlmon tune``: measure the num_workers x batch_size table of a training instead of guessing it.

plan     the grid, its defaults and the CLI's lists
model    pure functions: memory projection, the fitted per-worker memory model, the knee, skip rules
runner   runs one configuration under the agent and measures it
sweep    runs the plan, skipping what cannot fit, saving as it goes
report   the table, the recommendation, CSV and JSON
"""
