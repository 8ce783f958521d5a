"""The cluster harness: one way for the tools and the tests to start a runtime, know every process
of it by pid, signal them one by one, read their memory and metrics, and always stop them by pid.

- `runtime`: `RuntimeServer(ServerOptions(...), log_path)` is a real `tp-runtime serve` (torchrun's
  launcher, a worker per rank, rank 0's frontend). `start()` waits for /health 200 and labels each
  process (`launcher`, `rank0`.., `frontend`); `processes()`, `process_of(label or rank)`,
  `signal(target, sig)`, `survivors()` (orphans included), `wait_gone(timeout)`, `rss()`,
  `health()`, `wait_health(until, timeout)`, `metrics()`; `stop()` drains with SIGTERM and then
  kills by pid whatever is left. A context manager.
- `executors`: `ExecutorCluster(world_size, address=, key=, run_id=, options=, load=)` is N bare
  `run_executor` processes with a stand-in model, for a caller that speaks the protocol itself;
  `processes` (Popen by rank), `process_of(rank)`, `signal`, `wait_exit`, `survivors`, `rss`,
  `log(rank)`, `stop(grace_s)`. A context manager.
- `processes`: `ProcessRef` (pid + start time: never signals a reused pid), `descendants`, `alive`,
  `tagged`, `wait_gone`, `rss_bytes`, `spawn`, `ProcessTracker`, `free_port`.
- `client`: the OpenAI-compatible streaming client (`CompletionRequest`, `stream_completion`,
  `StreamResult`), `served_model`, `health_status`, `wait_for_health`.
- `metrics`: `parse_metrics`, `metrics_text`, `scrape_metrics`, `read_metrics`, `ThreadReadings` (each frontend thread's CPU and wake-ups), the runtime's metric names.
- `http_fuzz`: hypothesis strategies over every HTTP route and field (`CASES`, `edge_grid`), `send`,
  `check_answer` (no 5xx, JSON errors, well-formed streams), `greedy_text`.
- `output`: `percentile`, `write_json`, `default_out_dir`.
- `leak_check`: the pytest plugin (tests/conftest.py loads it) that fails a session which leaves a
  process running, and kills it.

Import from the modules (`from scripts.harness.runtime import RuntimeServer`); scripts put the
checkout's root on sys.path, the tests have it through pytest's `pythonpath`.
"""
