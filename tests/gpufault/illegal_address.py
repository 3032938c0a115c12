"""A program whose kernel faults: the error surfaces at the line that reads the result (fakecuda plays the driver)."""
import time

import fakecuda

import hangwatchd

for _ in range(5):
    hangwatchd.beat()
    time.sleep(0.05)
data = fakecuda.Tensor()
print(data.item())  # line 12: where the error surfaces
