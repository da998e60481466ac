# The liverl services: ingest API, feedback stream, analytics sink, gateway, learner and
# promotion controller share this image; each compose service picks its component by
# command. Production installs torch from PyPI as published (the learner trains on GPU);
# the CPU-wheel pin in pyproject.toml is what the build machines have on disk.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /srv/liverl

COPY pyproject.toml README.md ./
COPY liverl ./liverl
COPY app ./app
COPY ingest ./ingest
COPY feedback ./feedback
COPY serving ./serving
COPY learner ./learner
COPY sync ./sync
COPY policies ./policies
COPY promotion ./promotion
COPY rollouts ./rollouts
RUN pip install . \
    && useradd --system --create-home --uid 10001 liverl \
    && mkdir -p /data && chown liverl /data

# Never root: the services only write under LIVERL_DATA_DIR (/data, a volume).
USER liverl
ENV LIVERL_DATA_DIR=/data LIVERL_HOST=0.0.0.0
CMD ["liverl", "--help"]
