"""Shared test set-up: multi-rank checks go through ``harness.run``; one thread per process."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
