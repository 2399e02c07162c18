/* softverbs: a software double of libibverbs for tests (see docs/infiniband.md, last section).
 *
 * Environment:
 *   SOFTVERBS_DEVICES  devices, comma separated: NAME[:ib|:roce][:ports=N][:down=P][:ip=A.B.C.D][:subnet=N][:grh]
 *                      [:ece=HEX][:defprefix][:lid=N][:smlid=N]
 *                      (grh: the ports require a GRH, as IB SR-IOV VFs do: RTR without one is EINVAL;
 *                      ece: ibv_query_ece/ibv_set_ece work, the QPs support these ECE options; without
 *                      it they answer EOPNOTSUPP, as rxe does; defprefix: the IB GID prefix is fe80::
 *                      whatever the subnet, as where each plane's SM keeps its default; lid: the first
 *                      port's LID; smlid: the SM LID its ports report, default 1)
 *                      default "mlx5_0:ib,mlx5_1:ib". subnet is the fabric (plane): QPs of different
 *                      subnets cannot reach each other, as on a multi-plane cluster.
 *   SOFTVERBS_RECORD   a file; every QP's attributes are appended at RTR and RTS (one line each,
 *                      key=value), and its operation counters when it is destroyed.
 *   SOFTVERBS_FAULTS   comma separated: err_wr=N (the Nth send work request of this process completes
 *                      with err_status, default IBV_WC_RETRY_EXC_ERR=12), port_down_after=N (after N send
 *                      work requests the port goes down: IBV_EVENT_PORT_ERR, every QP on it fails),
 *                      port_flap_after=N (after N send WRs IBV_EVENT_PORT_ERR then IBV_EVENT_PORT_ACTIVE,
 *                      no QP affected: a flap shorter than the retry time), async_dead_after=N (after N
 *                      send WRs the device's async event channel breaks: readable, no event),
 *                      qp_fatal_after=N (IBV_EVENT_QP_FATAL on the QP of the Nth send WR), dev=NAME
 *                      (count only work requests on that device).
 *   SOFTVERBS_DMABUF   1: ibv_reg_dmabuf_mr is supported (maps the fd; a memfd works). Such an MR is GPU
 *                      memory: RDMA READ data landing there stays invisible until the device that placed
 *                      it reads GPU memory (a flush READ through a loopback QP) or writes there again.
 *   SOFTVERBS_NS       namespace for QP addresses (default: the uid), so parallel runs stay apart.
 */
#ifndef SOFTVERBS_H
#define SOFTVERBS_H

#define SV_RECORD_ENV "SOFTVERBS_RECORD"
#define SV_DEVICES_ENV "SOFTVERBS_DEVICES"
#define SV_FAULTS_ENV "SOFTVERBS_FAULTS"

#endif
