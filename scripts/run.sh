#!/bin/sh
# `make run`: train the default model.  Until the training CLI lands this
# shows the build works and which BLAS kernel ctrain runs.
exec build/ctrain version
