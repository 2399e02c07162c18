/* mplane: the NCCL net plugin ABI, versions 8 to 12, written by us from the documented layout.
 * Field order and types are ABI facts; a change here breaks every NCCL that loads us. */
#ifndef MPLANE_NCCL_NET_H
#define MPLANE_NCCL_NET_H

#include <stddef.h>
#include <stdint.h>
#include "common.h"
#include "err.h"
#include "net_device.h"

#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_NET_MAX_REQUESTS 32 /* requests in flight per comm, per NCCL */
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
#define NCCL_NET_TRAFFIC_CLASS_UNDEF (-1)
#define NCCL_NET_ID_UNDEF (-1)

#include "net_v8.h"
#include "net_v9.h"
#include "net_v10.h"
#include "net_v11.h"
#include "net_v12.h"

#endif
