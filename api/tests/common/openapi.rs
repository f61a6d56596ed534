//! Checks HTTP responses against `api/openapi.yaml`.
//!
//! A small validator for the JSON-schema subset the document uses (`$ref`, `type`, `required`,
//! `properties`, `additionalProperties: false`, `items`, `enum`, `pattern`, `minimum`). It is a
//! few dozen lines, builds instantly and fails loudly on any keyword it does not know, where a
//! full validator crate (`jsonschema`) would pull in a large dependency tree and still need
//! OpenAPI-3.0 glue for `$ref`s into `components`.

use api::client::HttpResponse;
use serde_json::Value;

/// Keywords that carry no constraint.
const ANNOTATIONS: &[&str] = &["description", "example", "format", "default"];

pub struct OpenApi {
    doc: Value,
}

impl OpenApi {
    pub fn load() -> Self {
        let doc: Value = serde_norway::from_str(api::OPENAPI_YAML).expect("openapi.yaml parses");
        assert_eq!(doc["openapi"].as_str().map(|v| &v[..2]), Some("3."));
        OpenApi { doc }
    }

    pub fn doc(&self) -> &Value {
        &self.doc
    }

    /// Follows a local `$ref` (`#/components/...`).
    pub fn resolve<'a>(&'a self, v: &'a Value) -> &'a Value {
        let mut v = v;
        for _ in 0..16 {
            match v.get("$ref").and_then(Value::as_str) {
                Some(r) => {
                    let ptr = r
                        .strip_prefix('#')
                        .unwrap_or_else(|| panic!("only local refs: {r}"));
                    v = self
                        .doc
                        .pointer(ptr)
                        .unwrap_or_else(|| panic!("unresolved $ref {r}"));
                }
                None => return v,
            }
        }
        panic!("$ref chain too long")
    }

    pub fn operation(&self, method: &str, endpoint: &str) -> &Value {
        let path = format!("/{endpoint}");
        self.doc["paths"]
            .get(&path)
            .and_then(|p| p.get(method.to_ascii_lowercase()))
            .unwrap_or_else(|| panic!("{method} {path} is not in openapi.yaml"))
    }

    /// Validates `value` against `schema`; the error names the JSON path.
    pub fn validate(&self, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
        let schema = self.resolve(schema);
        let obj = schema
            .as_object()
            .ok_or_else(|| format!("{at}: schema is not an object"))?;
        for key in obj.keys() {
            let known = [
                "type",
                "required",
                "properties",
                "additionalProperties",
                "items",
                "enum",
                "pattern",
                "minimum",
            ];
            if !known.contains(&key.as_str()) && !ANNOTATIONS.contains(&key.as_str()) {
                return Err(format!("{at}: unsupported schema keyword {key}"));
            }
        }
        if let Some(t) = obj.get("type").and_then(Value::as_str) {
            let ok = match t {
                "object" => value.is_object(),
                "array" => value.is_array(),
                "string" => value.is_string(),
                "integer" => value.is_i64() || value.is_u64(),
                "number" => value.is_number(),
                "boolean" => value.is_boolean(),
                other => return Err(format!("{at}: unknown type {other}")),
            };
            if !ok {
                return Err(format!("{at}: expected {t}, got {value}"));
            }
        }
        if let Some(e) = obj.get("enum").and_then(Value::as_array) {
            if !e.contains(value) {
                return Err(format!("{at}: {value} is not one of {e:?}"));
            }
        }
        if let (Some(p), Some(s)) = (obj.get("pattern").and_then(Value::as_str), value.as_str()) {
            let re = regex::Regex::new(p).map_err(|e| format!("{at}: bad pattern: {e}"))?;
            if !re.is_match(s) {
                return Err(format!("{at}: {s:?} does not match {p}"));
            }
        }
        if let (Some(m), Some(n)) = (obj.get("minimum").and_then(Value::as_f64), value.as_f64()) {
            if n < m {
                return Err(format!("{at}: {n} < minimum {m}"));
            }
        }
        if let Some(map) = value.as_object() {
            let props = obj.get("properties").and_then(Value::as_object);
            if let Some(req) = obj.get("required").and_then(Value::as_array) {
                for r in req.iter().filter_map(Value::as_str) {
                    if !map.contains_key(r) {
                        return Err(format!("{at}: missing required property {r}"));
                    }
                }
            }
            let closed = obj.get("additionalProperties") == Some(&Value::Bool(false));
            for (k, v) in map {
                match props.and_then(|p| p.get(k)) {
                    Some(s) => self.validate(s, v, &format!("{at}.{k}"))?,
                    None if closed => return Err(format!("{at}: unexpected property {k}")),
                    None => {}
                }
            }
        }
        if let (Some(items), Some(arr)) = (obj.get("items"), value.as_array()) {
            for (i, v) in arr.iter().enumerate() {
                self.validate(items, v, &format!("{at}[{i}]"))?;
            }
        }
        Ok(())
    }

    /// Validates a named component schema.
    pub fn validate_component(&self, name: &str, value: &Value) -> Result<(), String> {
        let schema = &self.doc["components"]["schemas"][name];
        assert!(schema.is_object(), "no schema {name}");
        self.validate(schema, value, name)
    }

    /// Panics unless `resp` is documented for `method endpoint` and its body fits the schema.
    /// 404 for unknown paths and 405 for wrong methods are generic and not per-path.
    pub fn check_response(&self, method: &str, endpoint: &str, resp: &HttpResponse) {
        // Query parameters are documented on the path's operation.
        let endpoint = endpoint.split_once('?').map_or(endpoint, |(p, _)| p);
        let path = format!("/{endpoint}");
        let op = self.doc["paths"]
            .get(&path)
            .and_then(|p| p.get(method.to_ascii_lowercase()));
        let Some(op) = op else {
            assert!(
                resp.status == 404 || resp.status == 405,
                "{method} {path} is undocumented but answered {}",
                resp.status
            );
            assert!(!resp.body.is_empty(), "404/405 carry a message");
            return;
        };
        let spec = op["responses"]
            .get(resp.status.to_string())
            .unwrap_or_else(|| {
                panic!(
                    "status {} of {method} {path} is not documented in openapi.yaml (body {:?})",
                    resp.status,
                    resp.body_text()
                )
            });
        let spec = self.resolve(spec);
        let ctype = resp.header("content-type").unwrap_or("");
        match spec.get("content").and_then(Value::as_object) {
            None => assert!(
                resp.body.is_empty(),
                "{method} {path} {}: expected no body, got {:?}",
                resp.status,
                resp.body_text()
            ),
            Some(content) => {
                if let Some(media) = content.get("application/json") {
                    assert!(
                        ctype.starts_with("application/json"),
                        "content-type {ctype}"
                    );
                    let body: Value = serde_json::from_slice(&resp.body).unwrap_or_else(|e| {
                        panic!(
                            "{method} {path}: body is not JSON ({e}): {}",
                            resp.body_text()
                        )
                    });
                    if let Err(e) = self.validate(&media["schema"], &body, "body") {
                        panic!(
                            "{method} {path} {}: response does not match openapi.yaml: {e}\n{body:#}",
                            resp.status
                        );
                    }
                } else if content.contains_key("text/plain") {
                    assert!(ctype.starts_with("text/plain"), "content-type {ctype}");
                    assert!(
                        !resp.body_text().trim().is_empty(),
                        "{method} {path} {}: empty error message",
                        resp.status
                    );
                } else {
                    panic!("unsupported media types {:?}", content.keys());
                }
            }
        }
    }
}
