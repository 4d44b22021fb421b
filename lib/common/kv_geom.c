/*
 * kv_geom: defaults of the shared cache geometry (kv_geom.h).
 */
#include "common/kv_geom.h"

#include <string.h>

void kv_geom_defaults(kv_geom *g)
{
    memset(g, 0, sizeof *g);
    g->rope_theta = 10000.0;
    g->rope_scaling = KV_ROPE_SCALING_NONE;
    g->keys_roped = true;
    g->rope_layout = KV_ROPE_INTERLEAVED;
}
