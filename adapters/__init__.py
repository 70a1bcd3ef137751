"""The faces of agentspec: LangChain chat model and executor, OpenAI-compatible server,
vLLM backend. Each lives in its own subpackage and imports its framework lazily."""
