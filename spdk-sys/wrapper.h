/* The SPDK headers katablk binds to (bindgen input; see build.rs). */
#include <spdk/stdinc.h>
#include <spdk/env.h>
#include <spdk/event.h>
#include <spdk/thread.h>
#include <spdk/bdev.h>
#include <spdk/bdev_module.h>
#include <spdk/jsonrpc.h>
#include <spdk/rpc.h>
#include <spdk/vhost.h>
#include <spdk/log.h>
