"""The session cache (SuffixDecoding scoped to sessions, agents and tenants), one word per
concept:

* :mod:`~agentspec.drafters.suffix.drafter` — :class:`SuffixDrafter`, the request lifecycle;
* :mod:`~agentspec.drafters.suffix.levels` — the history levels (session, agent, tenant) and
  their pools of turns;
* :mod:`~agentspec.drafters.suffix.config` — :class:`SuffixConfig`;
* :mod:`~agentspec.drafters.suffix.index` — the suffix index backends (arctic's C++ tree or
  the Python automaton);
* :mod:`~agentspec.drafters.suffix.automaton` — the pure-Python suffix automaton;
* :mod:`~agentspec.drafters.suffix.draft_tree` — merging drafts into one draft tree
  (compiled from ``_tree_merge.c`` where a C compiler is available).
"""
