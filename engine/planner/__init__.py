"""The planner: the candidate layouts and switches (`space`), their pricing and ranking
by the cost model (`search`), and the tables it prints (`report`)."""
