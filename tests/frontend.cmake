# frontend: the unit-building and row rules both CheckpointedOptimizers share (torch-free).
pmsnap_add_test(frontend_parameter_units_test SOURCES frontend_parameter_units_test.cc
                LIBS pmsnap::frontend)
# LowDiff+'s schedule: one claim per gradient and iteration, two buffers
# (copy t waits for the replica's t - 2), the first error, close.
pmsnap_add_test(frontend_replica_pipeline_test SOURCES frontend_replica_pipeline_test.cc
                LIBS pmsnap::frontend)
