"""The search: candidates, cost model, measurement workers, tuning database, reports."""
