# HMM start log-probabilities for the kv_jieba tests (made up for them).
P={'B': -0.3,
 'E': -3.14e+100,
 'M': -3.14e+100,
 'S': -1.4}
