"""Imports torch and never builds a DataLoader."""

import time

import torch  # noqa: F401

while True:
    time.sleep(0.5)
