"""The schema: every setting and data contract that crosses a tier boundary, defined once, torch-free.

Worker settings of each tier, the algorithm table, the rollout and preference batch contracts, the
weight-carrier descriptions and tensor references. Tiers import these; none keeps a copy.
"""
