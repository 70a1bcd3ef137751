"""Agent workloads: sessions of chat requests (DELEGATE-52 relays, InstructEdit-style edits,
tool-using agents, open chat, the smoke session), their data and their use as training data."""
