"""Chat on top of the decode loop: prompts, tool calls, message checks, grammars.

* :mod:`~agentspec.chat.templates` — chat template rendering (tools in the system prompt);
* :mod:`~agentspec.chat.tool_calls` — tool-call parsing from generated text;
* :mod:`~agentspec.chat.checks` — the message checks both front ends run;
* :mod:`~agentspec.chat.grammar` — grammar-constrained decoding (llguidance);
* :mod:`~agentspec.chat.grammar_sources` — the grammars of tool calls and response formats.
"""
