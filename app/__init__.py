"""The application: the `liverl` command line, the embedded-stack launcher and the demo.

It drives the components (`ingest/ feedback/ serving/ learner/ sync/ policies/`) from
outside; nothing in them or in the shared core (`liverl/`) imports it.
"""
