"""A client of the critic service, standard library only (urllib): timeouts, and retries that are safe.

    from critic_adapters.serve.client import CriticClient

    client = CriticClient("http://127.0.0.1:8000", token=open("user.token").read().strip())
    values, version = client.values(input_ids, attention_mask)          # nested lists in, lists out
    answer = client.update(input_ids=..., attention_mask=..., response_mask=..., old_values=..., returns=...)

A values request changes nothing, so it is simply sent again. An update carries a request_id (made
here when not given, kept across the retries of one call): the server applies it once and answers a
retry with the first answer, so a timeout or a dropped connection is retried without a second step.
Retried: connection errors, timeouts, 429 (after its Retry-After), 502/503/504. A 4xx is the caller's
to fix: ServiceError with the server's field and rule.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid

RETRIED_STATUSES = (429, 502, 503, 504)


class ServiceError(Exception):
    """The server refused or failed a request: `status` and its JSON `error` ({field, rule, message})."""

    def __init__(self, status: int, error: dict):
        self.status, self.error = status, error
        field = f"{error['field']}: " if error.get("field") else ""
        super().__init__(f"HTTP {status}: {field}{error.get('rule') or error.get('message')}")


class CriticClient:
    def __init__(self, url: str, token: str, *, timeout_s: float = 60.0, retries: int = 5, backoff_s: float = 0.5):
        self.url, self.token = url.rstrip("/"), token
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    def _once(self, method: str, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            raw = response.read()
        return json.loads(raw) if raw.strip().startswith(b"{") else {"text": raw.decode()}

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """One call, retried as the module says."""
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                return self._once(method, path, body)
            except urllib.error.HTTPError as err:
                raw = err.read()
                try:
                    error = json.loads(raw).get("error", {})
                except (json.JSONDecodeError, AttributeError):
                    error = {"message": raw.decode(errors="replace")}
                if err.code not in RETRIED_STATUSES or last:
                    raise ServiceError(err.code, error) from None
                wait = float(err.headers.get("Retry-After") or self.backoff_s * 2 ** attempt)
            except (urllib.error.URLError, TimeoutError, ConnectionError):
                if last:
                    raise
                wait = self.backoff_s * 2 ** attempt
            time.sleep(wait)
        raise AssertionError("unreachable")

    def values(self, input_ids, attention_mask, multi_modal_inputs=None) -> tuple[list, int]:
        """(values [rows][T], the critic version that computed them)."""
        body = {"input_ids": _lists(input_ids), "attention_mask": _lists(attention_mask)}
        if multi_modal_inputs is not None:
            body["multi_modal_inputs"] = multi_modal_inputs
        answer = self.request("POST", "/v1/values", body)
        return answer["values"], answer["version"]

    def update(self, *, input_ids, attention_mask, response_mask, old_values, returns, value_mask=None,
               request_id: str | None = None) -> dict:
        """One optimizer step; {request_id, version, metrics}. The same request_id on every retry."""
        body = {"request_id": request_id or uuid.uuid4().hex, "input_ids": _lists(input_ids),
                "attention_mask": _lists(attention_mask), "response_mask": _lists(response_mask),
                "old_values": _lists(old_values), "returns": _lists(returns)}
        if value_mask is not None:
            body["value_mask"] = _lists(value_mask)
        return self.request("POST", "/v1/update", body)

    def version(self) -> int:
        return self.request("GET", "/v1/version")["version"]

    def health(self) -> bool:
        try:
            self._once("GET", "/v1/health", None)
            return True
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            return False

    def save(self, path: str | None = None) -> dict:
        return self.request("POST", "/v1/save", {"path": path} if path else {})

    def load(self, path: str) -> dict:
        return self.request("POST", "/v1/load", {"path": path})

    def offload(self) -> dict:
        return self.request("POST", "/v1/offload", {})

    def onload(self) -> dict:
        return self.request("POST", "/v1/onload", {})


def _lists(value):
    """A tensor or array as nested lists (lists pass through)."""
    return value.tolist() if hasattr(value, "tolist") else value
