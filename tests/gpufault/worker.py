"""A worker process below the workload, never registered: its kernel faults (fakecuda plays the driver)."""
import time

import fakecuda

time.sleep(1.0)  # CUDA's start takes longer than the daemon takes to make this program's FIFO
fakecuda.Tensor().item()  # line 7: where the error surfaces
