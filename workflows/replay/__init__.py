"""``agentspec replay``: what a drafter would accept on real agent logs, with no model."""
