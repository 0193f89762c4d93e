//! Registering JSON-RPC methods in SPDK's RPC server, implemented in Rust.
//!
//! SPDK calls a method handler on the application thread with the request and its parsed
//! parameters. katablk's handlers may block (they open bdevs, which waits for the application
//! thread), so the trampoline converts the parameters to a [`serde_json::Value`], runs the
//! handler on one admin OS thread (methods are serialised, as in SPDK), and sends the reply
//! back to the application thread, where SPDK's JSON-RPC calls must be made.
//!
//! Register methods before [`crate::app::SpdkApp::start`] (SPDK reads the table when a request
//! arrives, on the application thread; registering later races with it).

use std::ffi::{c_void, CString};
use std::sync::{mpsc, Arc, Mutex, OnceLock};

use serde_json::Value;
use tracing::warn;

use crate::ffi;
use crate::json::Token;
use crate::thread::Thread;
use crate::Error;

/// A method's error reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodError {
    /// JSON-RPC error code (-32602 invalid params, or a negative errno as SPDK uses).
    pub code: i32,
    /// Message.
    pub message: String,
}

impl MethodError {
    /// An error with `code` and `message`.
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        MethodError {
            code,
            message: message.into(),
        }
    }
}

/// A method implementation: parameters (`Value::Null` when absent) to a result.
pub type Handler = Arc<dyn Fn(Value) -> Result<Value, MethodError> + Send + Sync>;

/// How many Rust methods can be registered.
pub const MAX_METHODS: usize = 16;

static HANDLERS: Mutex<Vec<(String, Handler)>> = Mutex::new(Vec::new());

type Job = Box<dyn FnOnce() + Send>;
static ADMIN: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();

fn admin() -> Result<mpsc::Sender<Job>, Error> {
    let m = ADMIN.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("katablk-rpc".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            });
        if let Err(e) = spawned {
            warn!("cannot start the RPC admin thread: {e}");
        }
        Mutex::new(tx)
    });
    m.lock().map(|t| t.clone()).map_err(|_| Error::Stopped)
}

/// A request pointer carried to the admin thread and back (only dereferenced by SPDK on the
/// application thread).
#[derive(Clone, Copy)]
struct Req(*mut ffi::spdk_jsonrpc_request);
// SAFETY: the pointer is only passed back to SPDK on the application thread.
unsafe impl Send for Req {}

fn reply(req: Req, r: Result<Value, MethodError>) {
    match r {
        Ok(v) => {
            let text = v.to_string();
            // SAFETY: on the application thread (the RPC server's); `req` has not been
            // answered yet; `text` lives across the calls.
            unsafe {
                let w = ffi::spdk_jsonrpc_begin_result(req.0);
                if w.is_null() {
                    return; // a notification: no reply
                }
                ffi::spdk_json_write_val_raw(w, text.as_ptr().cast::<c_void>(), text.len());
                ffi::spdk_jsonrpc_end_result(req.0, w);
            }
        }
        Err(e) => {
            let msg = CString::new(e.message.replace('\0', " ")).unwrap_or_default();
            // SAFETY: as above; SPDK copies the message.
            unsafe { ffi::spdk_jsonrpc_send_error_response(req.0, e.code, msg.as_ptr()) };
        }
    }
}

/// Copies SPDK's token array for `params` (may be NULL).
///
/// # Safety
/// `params` must be NULL or point to a parsed value followed by its tokens.
unsafe fn tokens(params: *const ffi::spdk_json_val) -> Vec<Token> {
    if params.is_null() {
        return vec![Token::Null];
    }
    // SAFETY: per the contract, `params` starts a complete value of `n` tokens.
    let n = unsafe { ffi::spdk_json_val_len(params) };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: i < n tokens of the value.
        let v = unsafe { &*params.add(i) };
        let text = || {
            // SAFETY: for strings, names and numbers `start`/`len` delimit the (decoded) text.
            let b = unsafe { std::slice::from_raw_parts(v.start.cast::<u8>(), v.len as usize) };
            String::from_utf8_lossy(b).into_owned()
        };
        out.push(match v.type_ {
            ffi::SPDK_JSON_VAL_NULL => Token::Null,
            ffi::SPDK_JSON_VAL_TRUE => Token::True,
            ffi::SPDK_JSON_VAL_FALSE => Token::False,
            ffi::SPDK_JSON_VAL_NUMBER => Token::Number(text()),
            ffi::SPDK_JSON_VAL_STRING => Token::String(text()),
            ffi::SPDK_JSON_VAL_NAME => Token::Name(text()),
            ffi::SPDK_JSON_VAL_ARRAY_BEGIN => Token::ArrayBegin(v.len),
            ffi::SPDK_JSON_VAL_ARRAY_END => Token::ArrayEnd,
            ffi::SPDK_JSON_VAL_OBJECT_BEGIN => Token::ObjectBegin(v.len),
            ffi::SPDK_JSON_VAL_OBJECT_END => Token::ObjectEnd,
            _ => Token::Null,
        });
    }
    out
}

fn dispatch(slot: usize, req: *mut ffi::spdk_jsonrpc_request, params: *const ffi::spdk_json_val) {
    let req = Req(req);
    // SAFETY: SPDK passes the request's parsed parameters (or NULL), valid during this call.
    let toks = unsafe { tokens(params) };
    let handler = HANDLERS
        .lock()
        .ok()
        .and_then(|h| h.get(slot).map(|(_, f)| f.clone()));
    let (Some(handler), Some(app)) = (handler, Thread::current()) else {
        reply(req, Err(MethodError::new(-32603, "method not available")));
        return;
    };
    let value = match crate::json::tokens_to_value(&toks) {
        Ok(v) => v,
        Err(e) => {
            reply(
                req,
                Err(MethodError::new(-32602, format!("invalid parameters: {e}"))),
            );
            return;
        }
    };
    let job: Job = Box::new(move || {
        let r = handler(value);
        if app.send(move || reply(req, r)).is_err() {
            warn!("SPDK stopped before an RPC reply could be sent");
        }
    });
    match admin() {
        Ok(tx) => {
            if let Err(mpsc::SendError(job)) = tx.send(job) {
                drop(job);
                reply(
                    req,
                    Err(MethodError::new(-32603, "RPC admin thread is gone")),
                );
            }
        }
        Err(_) => reply(
            req,
            Err(MethodError::new(-32603, "RPC admin thread is gone")),
        ),
    }
}

macro_rules! trampolines {
    ($($n:literal => $f:ident),* $(,)?) => {
        $(
            unsafe extern "C" fn $f(
                req: *mut ffi::spdk_jsonrpc_request,
                params: *const ffi::spdk_json_val,
            ) {
                dispatch($n, req, params)
            }
        )*
        const TRAMPOLINES: [unsafe extern "C" fn(
            *mut ffi::spdk_jsonrpc_request,
            *const ffi::spdk_json_val,
        ); MAX_METHODS] = [$($f),*];
    };
}

trampolines!(
    0 => t0, 1 => t1, 2 => t2, 3 => t3, 4 => t4, 5 => t5, 6 => t6, 7 => t7,
    8 => t8, 9 => t9, 10 => t10, 11 => t11, 12 => t12, 13 => t13, 14 => t14, 15 => t15,
);

/// Registers `name` in SPDK's RPC server (allowed at runtime, like SPDK's own methods).
pub fn register_method(
    name: &str,
    handler: impl Fn(Value) -> Result<Value, MethodError> + Send + Sync + 'static,
) -> Result<(), Error> {
    let cname = CString::new(name).map_err(|_| Error::InvalidName(name.to_string()))?;
    let mut h = HANDLERS.lock().map_err(|_| Error::Stopped)?;
    if h.iter().any(|(n, _)| n == name) {
        return Err(Error::InvalidName(format!("{name} registered twice")));
    }
    let slot = h.len();
    let tramp = *TRAMPOLINES
        .get(slot)
        .ok_or_else(|| Error::InvalidName(format!("more than {MAX_METHODS} methods")))?;
    h.push((name.to_string(), Arc::new(handler)));
    // SAFETY: SPDK keeps the name pointer: leak it for the life of the process (methods are
    // never unregistered). Registering before the app starts is not racing SPDK's readers.
    unsafe { ffi::spdk_rpc_register_method(cname.into_raw(), Some(tramp), ffi::SPDK_RPC_RUNTIME) };
    Ok(())
}
