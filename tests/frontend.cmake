# frontend: the unit-building and row rules both CheckpointedOptimizers share (torch-free).
pmsnap_add_test(frontend_parameter_units_test SOURCES frontend_parameter_units_test.cc
                LIBS pmsnap::frontend)
