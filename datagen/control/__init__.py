"""The control plane: every Redis key and script, job state, fair-share dispatch, enqueue, the
prompt payload, the server registry and the epoch. The only room of ``datagen`` that imports
``redis`` or ``rq``."""
