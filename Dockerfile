# hangwatchd as a sidecar image: the daemon, py-spy, nvdisasm (PyPI) and NVML bindings, every
# version pinned by constraints.txt (the same file the test environment is installed with), and
# the job side as one file, /opt/hangwatchd/job/hangwatchd-job.pyz, for an init container to hand
# to a workload container that has no hangwatchd (deploy/kubernetes/pod.yaml).
#   ./dev image          builds it (base included, no registry needed) and smoke-tests it
#   podman build --build-arg BASE=IMAGE -t hangwatchd:0.1.0 .
# BASE is any Debian bookworm (or newer) image with python3 and python3-venv; ./dev image makes
# one from Debian's package archive with mmdebstrap, so no container registry is needed.
#   podman run --pid=host --cap-add SYS_PTRACE,SYSLOG --device /dev/kmsg:/dev/kmsg:r -v /run/hangwatchd:/run/hangwatchd \
#     -v /var/lib/hangwatchd:/var/lib/hangwatchd -p 9842:9842 hangwatchd:0.1.0
# SYSLOG and the host's /dev/kmsg let the daemon read the driver's NVRM Xid lines, which name the process
# behind each GPU fault (config kernel_log; the pids are the host's: with --pid=host they are the daemon's
# too). Without them it says so once and takes XIDs from NVML alone, without their process.
ARG BASE=localhost/hangwatchd-base:bookworm
FROM ${BASE}
# ./dev image prunes the superseded (dangling) builds carrying this label, and only those.
LABEL io.hangwatchd.image=sidecar

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Where HTTPS goes through a proxy with its own CA, ./dev image passes the host's bundle
# (--build-arg PIP_CERT=... with the file mounted); it is not kept in the image.
ARG PIP_CERT
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY hangwatchd ./hangwatchd
# PIP_CONSTRAINT (not -c) so the pins hold in pip's isolated build environment too (setuptools).
# The installers (the venv's own pip and setuptools, from Debian's python3-venv) are not shipped.
RUN python3 -m venv /opt/hangwatchd \
 && PIP_CONSTRAINT=/src/constraints.txt /opt/hangwatchd/bin/pip install --no-compile "/src[daemon,nvdisasm]" \
 && /opt/hangwatchd/bin/pip uninstall -y -q setuptools pip \
 && mkdir /opt/hangwatchd/job && /opt/hangwatchd/bin/python -m hangwatchd.workload.bundle /opt/hangwatchd/job \
 && cd / && rm -rf /src
ENV PATH=/opt/hangwatchd/bin:$PATH
WORKDIR /

COPY config/hangwatchd.toml /etc/hangwatchd/hangwatchd.toml
EXPOSE 9842
ENTRYPOINT ["hangwatchd"]
CMD ["daemon", "--config", "/etc/hangwatchd/hangwatchd.toml"]
