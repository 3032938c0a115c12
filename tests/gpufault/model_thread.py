"""A serving loop whose model thread meets the fault; the main thread waits for its output (fakecuda plays the driver)."""
import queue
import threading
import time

import fakecuda

import hangwatchd

outputs: "queue.Queue[float]" = queue.Queue()


def run_model() -> None:
    time.sleep(0.3)
    outputs.put(fakecuda.Tensor().item())  # line 15: where the error surfaces, in thread model-runner


threading.Thread(target=run_model, name="model-runner").start()
for _ in range(5):
    hangwatchd.beat()
    time.sleep(0.05)
outputs.get()
