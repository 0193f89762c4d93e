# Disk provider for guest-e2e.sh through katablk-target (SPDK JSON-RPC): NOT WIRED UP YET.
# The functions and their contract are those of providers/vhost.sh. What they are to do once
# katablk-target lands (it speaks SPDK's methods, so SPDK's `vhost -S DIR -r RPC` works the same):
#
#   provider_start NAME SIZE_MIB QUEUES SERIAL
#       katablk-target -S "$E2E_RUN_DIR/sockets" -r "$E2E_RUN_DIR/rpc.sock" &
#       rpc bdev_aio_create {filename: $E2E_RUN_DIR/pool.img, name: aio0}         (once)
#       rpc bdev_lvol_create_lvstore {bdev_name: aio0, lvs_name: lvs0}            (once)
#       rpc bdev_lvol_create {lvol_name: NAME, size_in_mib: SIZE_MIB, lvs_name: lvs0}
#       rpc vhost_create_blk_controller {ctrlr: NAME, dev_name: lvs0/NAME}
#       DISK_SOCK=$E2E_RUN_DIR/sockets/NAME  DISK_BACKING=""  (an lvol has no flat file; the
#       host-side checksum comparison is then skipped)
#   provider_restart   kill -9 katablk-target, start it again with the same flags; the lvstore
#                      and controllers must come back by themselves (DESIGN.md section 8)
#   provider_grow NEW_MIB   rpc bdev_lvol_resize {name: lvs0/NAME, size_in_mib: NEW_MIB}; the
#                      controller sends CONFIG_CHANGE_MSG and the guest sees the new size
#   provider_stop      rpc vhost_delete_controller, bdev_lvol_delete; kill the target
#
# A provider "csi" would do the same through katablk-csi's gRPC socket (CreateVolume with node
# topology, NodePublishVolume with volumeMode Block to a target path under $E2E_RUN_DIR) and
# take DISK_SOCK from the published device: <store>/block/sockets/<name of the device node>.
provider_start() {
    echo "provider 'target' is not implemented yet: katablk-target has not landed" >&2
    return 1
}
provider_restart() { return 1; }
provider_can_grow() { echo "not implemented"; return 1; }
provider_grow() { return 1; }
provider_stop() { :; }
