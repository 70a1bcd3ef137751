"""Chat on top of the decode loop: prompts, tool calls, message checks, grammars.

* :mod:`~agentspec.chat.formats` — tool-call formats as data (hermes, llama3_json, mistral
  v3 / v11, the fallback preamble) and the choice of a model's format;
* :mod:`~agentspec.chat.templates` — chat template rendering in the model's tool format;
* :mod:`~agentspec.chat.tool_calls` — tool-call parsing from generated text;
* :mod:`~agentspec.chat.checks` — the message checks both front ends run;
* :mod:`~agentspec.chat.grammar` — grammar-constrained decoding (llguidance);
* :mod:`~agentspec.chat.grammar_sources` — the grammars of tool calls and response formats;
* :mod:`~agentspec.chat.turn` — :class:`~agentspec.chat.turn.ChatTurn`, the one request type
  of a chat turn (both runtimes take it; the server and LangChain build it);
* :mod:`~agentspec.chat.stream` — :class:`~agentspec.chat.stream.ResultStream`, text deltas
  then a returned result;
* :mod:`~agentspec.chat.base` — :class:`~agentspec.chat.base.BaseChatRuntime`, the steps
  every turn shares (each runtime supplies its decode);
* :mod:`~agentspec.chat.api` — the faces' contract (``ChatRuntime``), ``ChatResult``,
  prompt rendering.
"""
