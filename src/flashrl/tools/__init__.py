"""The commands on top of the library: the `flashrl` CLI (`cli`, `args`, `checks`, `generate`,
`train`), `bench`, `profile` (+ `profile_metrics`, `profile_report`, `calibration_prompts`),
`setup` and `verify` (+ `verify_checks`, `verify_vllm`, `verify_context`). Each subcommand's flags
come from a dataclass; each command returns a dataclass (`BenchResult`, `ProfileResult`,
`CheckResult` rows) that its JSON output is written from."""
