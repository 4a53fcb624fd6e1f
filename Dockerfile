# One image for every gpusched service (router, scheduler, gpu-agent, accounting) and the ops
# CLI; docker-compose.yml picks the service with `command: python -m <package>`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GPUSCHED_CONFIG_DIR=/app/config \
    GPUSCHED_HTTP_HOST=0.0.0.0

WORKDIR /app

COPY libs ./libs
COPY services ./services
COPY ops ./ops
COPY constraints.txt ./
RUN pip install -c constraints.txt \
        ./libs/common \
        ./services/router \
        ./services/scheduler \
        ./services/gpu-agent \
        ./services/accounting \
        ./ops \
    && rm -rf ./libs ./services ./ops constraints.txt

COPY config ./config

# Numba's cache of the scheduler's compiled solver kernels, in a folder its user owns: beside
# the installed code (root's) it cannot write, and its fallback in the container's home went
# with the container, so every new one compiled them again (up to a minute on 2 cores).
# docker-compose.yml keeps this folder on a volume, which takes the folder's owner.
ENV NUMBA_CACHE_DIR=/var/cache/gpusched/numba
RUN useradd --create-home --uid 10001 gpusched \
    && install -d -o gpusched -g gpusched "$NUMBA_CACHE_DIR"
USER gpusched

EXPOSE 8080 8081 8082 8090 8091
CMD ["python", "-m", "gpusched_router"]
