"""E-graph rewrites: from the primitive graph to fused kernel forms and their schedules."""
