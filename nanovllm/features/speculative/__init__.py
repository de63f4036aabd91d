"""Speculative decoding (vLLM's `speculative_config`): tokens drafted cheaply and verified by the
target model in one step, each accepted token saving a step. options.py reads the config;
drafting.py puts drafts into the scheduler's decode steps (a SchedulingHook) from one proposer
per method (proposers.py): ngram.py (prompt lookup), draft_model.py (a smaller model),
eagle3.py (an EAGLE-3 head, eagle3_head.py, reading the target layer inputs layer_inputs.py
keeps); the core samples each drafted position and Drafting.verify keeps the tokens."""
