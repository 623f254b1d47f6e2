"""The critic as an HTTP service (docs/SERVE.md): python -m critic_adapters.serve.

  launch.py    the command: the training launcher's config and layout, the run_dir checks, torchrun ranks
               (or a Ray group), resume, the server's start and clean stop
  ranks.py     rank 0 leads the torchrun ranks: each request's work broadcast, every rank its share
  batcher.py   the engine thread: one queue, values requests packed into engine calls, updates in order
  ledger.py    exactly-once updates: answers by request_id, the journal that survives a restart
  schema.py    request bodies checked before anything runs (4xx naming the field and the rule)
  app.py       the FastAPI routes: auth, limits, backpressure, statuses
  metrics.py   Prometheus text
  client.py    a Python client (standard library only) with timeouts and safe retries

Importing this package imports nothing heavy; fastapi and uvicorn are the `serve` extra.
"""
