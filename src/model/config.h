// The model description lives in model/spec.h; this header keeps the older include path working.
#pragma once
#include "model/spec.h"
