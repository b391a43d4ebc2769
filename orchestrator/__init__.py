"""cona's control plane: profiles, the strategy planner and cost model, statistics, policies, backends, CLI."""
