"""The command line as a user meets it: real subprocesses, bad input, signals, the lifeline."""
