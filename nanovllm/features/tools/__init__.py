"""Tool calls (OpenAI's `tools` / `tool_choice`): what a request's tool choice asks of the output
(`choice.py`: a constraint for "required" and a named function, checked tool definitions) and
how calls are read back out of the model's text (`parsers.py`: Hermes / Qwen's
`<tool_call>` blocks, Llama 3's JSON)."""
