"""The platform's own code location: assets about all teams (usage and cost)."""
