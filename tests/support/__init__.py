"""What the tests share, and the only test code a test module imports besides conftest fixtures.

``wait``: polling until a condition holds (one loop for sync tests, one for async). ``specs``: job
specs as clients submit them. ``sim``: the simulator served over real HTTP. ``metrics``: reading a
/metrics page. ``processes``: ``python -m datagen_cli …`` child processes and the coordinator. ``workers``:
fast worker settings, jobs ingested by hand, a worker started and stopped. ``ingest``, ``records``,
``export_jobs``: jobs and records written the way the coordinator and the workers write them.
``faults``, ``e2e``, ``deploy``: the harnesses of those suites. ``planted``, ``conversations``,
``redisproxy``: test data and a TCP proxy. ``calltrace``: the modules a prompt ran through.
``rendering``: renderer helpers only tests use. ``doc_blocks``: a page's marked shell blocks run in
order. Ports come from ``datagen_cli.local.redis_server.free_port``.
"""
