/* The data segments sent by every TCP socket this process holds (tcp_segs.c); 0 where the kernel
 * does not count them. */
#ifndef MPLANE_TEST_TCP_SEGS_H
#define MPLANE_TEST_TCP_SEGS_H
#include <stdint.h>
uint64_t tcp_data_segs_out(void);
#endif
