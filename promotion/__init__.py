"""The promotion station: a process of its own that decides what serves.

It reads the registry (`policies/`) and live figures (the sink), judges canaries with an
always-valid test (`sequential.py`), and moves replicas (`promoter.py`, through
`serving/`'s verified swaps). It sits above the components it drives; none imports it.
"""
