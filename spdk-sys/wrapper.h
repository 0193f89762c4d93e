/* The SPDK headers katablk binds to (bindgen input; see build.rs). */
#include <spdk/stdinc.h>
#include <spdk/env.h>
#include <spdk/event.h>
#include <spdk/thread.h>
#include <spdk/bdev.h>
#include <spdk/jsonrpc.h>
#include <spdk/rpc.h>
#include <spdk/log.h>
#include <spdk/init.h>
#include <spdk/json.h>
#include <spdk/util.h>
