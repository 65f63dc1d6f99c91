"""HTTP load generator and user-facing metrics for the speech endpoint (`python -m bench.loadgen --help`).

client.py   one timed streaming request (aiohttp)      runner.py   closed / open loop, the sweep
metrics.py  percentiles, playback continuity (pure)    summary.py  per-request and per-point figures (pure)
report.py   results.json, results.md, PNG plots        sentences   the texts (sentences.txt)
ready.py    wait for GET /ready (GPU runbook)          serve_config.py  the runbook's Serve config
"""
