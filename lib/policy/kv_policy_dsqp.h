/*
 * kv_policy_dsqp: a dsq layer's codec parameters from its policy
 * parameters, the one conversion the CPU policy, the GPU engine, the
 * policy check and kv-quant --profile share.
 */
#ifndef KV_POLICY_DSQP_H
#define KV_POLICY_DSQP_H

#include "policy/kv_policy.h"
#include "quant/kv_dsq.h"

/* k: the keys' (dsq_kbits), v: the values' (dsq_vbits); window, salient
 * count, base and group alike.  v may be NULL. */
void kv_policy_dsq_params(const kv_policy_params *p, kv_dsq_params *k, kv_dsq_params *v);

#endif
