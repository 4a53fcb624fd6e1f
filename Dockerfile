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

RUN useradd --create-home --uid 10001 gpusched
USER gpusched

EXPOSE 8080 8081 8082 8090 8091
CMD ["python", "-m", "gpusched_router"]
