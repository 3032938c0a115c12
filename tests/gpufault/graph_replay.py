"""A CUDA graph whose kernel faults during its replay (fakecuda plays the driver)."""
import time

import fakecuda

import hangwatchd

for _ in range(5):
    hangwatchd.beat()
    time.sleep(0.05)
g = fakecuda.CUDAGraph()
g.replay()  # line 12: the graph's replay, where the error surfaces
