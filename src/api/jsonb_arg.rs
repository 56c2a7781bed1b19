//! A `jsonb` argument taken as its text. pgrx's `JsonB` parses the value with serde_json while
//! unboxing the argument and panics on a value that serde_json cannot hold (a number such as
//! `1e400`, nesting deeper than 128 levels): the caller got `XX000` with a Rust backtrace before
//! the function could say what is wrong. Taken as text, the value is checked by
//! [`crate::headers`] and refused with `22023`.

use pgrx::callconv::{Arg, ArgAbi};
use pgrx::nullable::Nullable;
use pgrx::prelude::*;
use pgrx::{direct_function_call, FromDatum};
use std::ffi::CStr;

/// The text of a `jsonb` argument (the SQL type stays `jsonb`).
pub struct JsonbArg(pub String);

impl FromDatum for JsonbArg {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<Self> {
        if is_null {
            return None;
        }
        // SAFETY: the datum is the function's jsonb argument; jsonb_out detoasts it and returns
        // a palloc'd C string that lives until the call's memory context is reset.
        let text = unsafe { direct_function_call::<&CStr>(pg_sys::jsonb_out, &[Some(datum)]) }?;
        Some(JsonbArg(text.to_string_lossy().into_owned()))
    }
}

// SAFETY: unboxes through FromDatum exactly as pgrx does for its own jsonb type.
unsafe impl<'fcx> ArgAbi<'fcx> for JsonbArg {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        let index = arg.index();
        // SAFETY: the caller guarantees a non-null argument of type jsonb.
        unsafe { arg.unbox_arg_using_from_datum() }
            .unwrap_or_else(|| panic!("argument {index} must not be null"))
    }

    unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
        // SAFETY: an argument of type jsonb, possibly null.
        unsafe { arg.unbox_arg_using_from_datum() }.into()
    }
}

impl_sql_translatable!(JsonbArg, arg_only = "jsonb");
