/*
 * ctrain: training neural networks across many workers in plain C.
 * This umbrella header includes every public module.
 */
#ifndef CTRAIN_H
#define CTRAIN_H

#include "core.h"
#include "tensor.h"
#include "nn.h"
#include "optim.h"
#include "comm.h"
#include "parallel.h"
#include "comm_hook.h"
#include "io.h"
#include "models.h"
#include "checkpoint.h"

#endif
