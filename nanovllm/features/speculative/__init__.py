"""Speculative decoding (vLLM's `speculative_config`): tokens drafted cheaply and verified by the
target model in one step, each accepted token saving a step. options.py reads the config,
ngram.py drafts by prompt lookup, drafting.py puts drafts into the scheduler's decode steps (a
SchedulingHook); the core verifies them (core/lifecycle.py's RequestLifecycle._accept_drafted)."""
