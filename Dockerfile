# hangwatchd as a sidecar image: the daemon, py-spy, nvdisasm (PyPI) and NVML bindings.
#   docker build -t hangwatchd:0.1.0 .
#   docker run --rm --pid=host --cap-add SYS_PTRACE -v /run/hangwatchd:/run/hangwatchd \
#     -v /var/lib/hangwatchd:/var/lib/hangwatchd -p 9842:9842 hangwatchd:0.1.0
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hangwatchd ./hangwatchd
RUN pip install ".[nvdisasm]" nvidia-ml-py && rm -rf /src

COPY config/hangwatchd.toml /etc/hangwatchd/hangwatchd.toml
EXPOSE 9842
ENTRYPOINT ["hangwatchd"]
CMD ["daemon", "--config", "/etc/hangwatchd/hangwatchd.toml"]
